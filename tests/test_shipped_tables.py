"""The tuned kernel tables shipped per GPU (moe_inductor/kernels/tuned/<GPU>.json): every entry is a config the
tuner could have picked for its key, and a GPU's table is the one its name loads."""
import json
import re

import pytest
import torch

from moe_inductor.kernels import configs

TABLES = sorted(configs._TUNED_DIR.glob("*.json"))
#: launch.py's keys: the GEMM's (``|il``: interleaved gate/up pairs), then its tail's or its TMA launch's
KEY = re.compile(r"^(gemm\|E\d+\|N\d+\|K\d+\|torch\.(bfloat16|float16|float32)\|g[01]\|a\d+\|c\d+\|m\d+(?:\|il)?)"
                 r"(\|tail|\|tma|\|kn\|tma)?$")


def test_the_h100_and_the_h200_ship_tables():
    assert {p.stem for p in TABLES} >= {"NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"}


@pytest.mark.parametrize("path", TABLES, ids=[p.stem for p in TABLES])
def test_every_entry_is_one_of_the_tuners_candidates_for_its_key(path):
    """A GEMM key holds one of ``gemm_candidates``; a tail key its GEMM's config (no split) or one of
    ``tail_candidates``; a TMA key POINTERS or one of ``tma_candidates`` (all three from the key's own GEMM entry)."""
    table = {key: configs.LaunchConfig(**cfg) for key, cfg in json.loads(path.read_text()).items()}
    assert table
    for key, cfg in table.items():
        match = KEY.match(key)
        assert match, key
        base, dtype, kind = match.group(1), getattr(torch, match.group(2)), match.group(3)
        gated = "|g1|" in key
        if kind is None:
            assert cfg in configs.gemm_candidates(dtype), (key, cfg)
        elif base not in table:  # (a tail or TMA key whose GEMM key was tuned elsewhere: a tile of some GEMM;
            # POINTERS only where it means "no TMA": as a tail it would launch tiles of no rows)
            assert cfg in configs.gemm_candidates(dtype) or (kind != "|tail" and cfg == configs.POINTERS), (key, cfg)
        elif kind == "|tail":
            assert cfg in configs.tail_candidates(table[base], dtype, gated), (key, cfg)
        else:
            assert cfg in configs.tma_candidates(table[base], dtype, gated), (key, cfg)


def test_a_gpus_name_loads_its_table(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_INDUCTOR_CACHE_DIR", str(tmp_path))  # no user cache: the shipped table alone
    monkeypatch.setattr(configs.ConfigTable, "device_tag", staticmethod(lambda: "NVIDIA_H100_80GB_HBM3"))
    table = configs.ConfigTable()
    key = "gemm|E60|N1408|K2048|torch.bfloat16|g1|a1|c0|m512"
    assert table.lookup(key) == configs.LaunchConfig(128, 128, 64, 8, 3, 8)
