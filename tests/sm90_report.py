"""Every Triton kernel of moe_inductor compiled for the H200 (sm_90) without a GPU, with the configs the launchers
pick (``sm90_kernel_report``): Triton's front end and the ptxas it ships run on the CPU. tests/test_sm90_compile.py
reads its report in a process without the interpreter."""
import json
import os
import re
import subprocess
from pathlib import Path

import torch


# ints Triton sees unaligned at a real launch, so the sm_90 compile does not assume 16-byte divisibility for them
_NOT_SPECIALISED = {"topk", "num_a_rows", "num_tiles", "M", "T", "num_experts", "capacity", "num_chunks"}


def _compile_for_sm90(name, fn, pointer_types, constexprs, *, floats=(), num_warps=4, num_stages=3) -> None:
    """Compile ``fn`` for sm_90 as a launch with 16-byte aligned pointers and strides would specialise it (unit
    strides go in as the constant 1, as Triton specialises them); print one JSON line: name, shared memory, whether
    the PTX uses wgmma, registers and stack bytes (spills) per thread."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr or p.name in constexprs:
            signature[p.name] = "constexpr"
        elif p.name.startswith("p_"):
            signature[p.name] = pointer_types.get(p.name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif p.name in floats:
            signature[p.name] = "fp32"
        else:
            signature[p.name] = "i32"
            if p.name not in _NOT_SPECIALISED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = kernel.asm["ptx"]
    # 16-byte asynchronous copies to shared memory: the pipelined, vectorised loads of a GEMM's operands
    copies16 = len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*, 0x10", ptx))
    print(json.dumps({"name": name, "shared": kernel.metadata.shared, "wgmma": "wgmma" in ptx, "copies16": copies16,
                      **_resource_usage(kernel.asm["cubin"])}), flush=True)


def _resource_usage(cubin: bytes) -> dict:
    """Registers per thread and stack bytes (register spills) from the cubin, by the cuobjdump Triton ships."""
    import tempfile

    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"registers": int(found.group(1)), "stack": int(found.group(2))} if found else {}


def _sm90_gemm(name, cfg, dtype, *, gated, a_rows, c_rows, save_pre=False, k_dim=4096, interleaved=False,
               tma=False, table=False, act=4) -> None:
    from moe_inductor.kernels.grouped_gemm import grouped_gemm_kernel

    pointers = {n: f"*{dtype}" for n in ("p_a", "p_b", "p_b2", "p_bias", "p_bias2", "p_c", "p_pre", "p_scale")}
    pointers.update(p_b_table="*i64", p_b2_table="*i64")
    constexprs = dict(
        stride_ak=1, stride_cn=1, stride_pre_n=1, NUM_EXPERTS=8, E_POW2=8, A_ROWS=a_rows, C_ROWS=c_rows,
        SCALE_MODE=2, GATED=gated, ACT=act, HAS_BIAS=False, SAVE_PRE=save_pre, ACCUMULATE=False, UPCAST=False,
        DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, EVEN_K=k_dim % cfg.BLOCK_K == 0, INTERLEAVED=interleaved)
    if interleaved:  # GPT-OSS's (E, K, 2N) gate_up: N contiguous, with biases and its clamped glu
        constexprs.update(stride_bn=1, HAS_BIAS=True, ACT=5)
    else:  # nn.Linear-style weights: K contiguous
        constexprs.update(stride_bk=1, stride_b2k=1)
    if table:  # per-expert weights through their table of places (the list op), 16-byte aligned
        constexprs.update(B_TABLE=8 if dtype == "bf16" else 4)
    if tma:  # a "|tma" entry's launch: weights (and sorted rows) through descriptors made in the kernel, persistent
        constexprs.update(B_DESC=2, B_NK=not interleaved, A_DESC=a_rows == 0, PERSISTENT=True)
    _compile_for_sm90(name, grouped_gemm_kernel, pointers, constexprs, floats=("alpha", "limit"),
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _sm90_weight_grad(name, cfg, dtype, *, a_rows=1, g_rows=0, has_scale=True) -> None:
    from moe_inductor.kernels.grouped_gemm import grouped_weight_grad_kernel

    constexprs = dict(stride_ak=1, stride_gn=1, stride_wn=1, A_ROWS=a_rows, G_ROWS=g_rows,
                      HAS_SCALE=has_scale, UPCAST=False, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
                      BLOCK_M=cfg.BLOCK_M, BLOCK_K=cfg.BLOCK_K, BLOCK_N=cfg.BLOCK_N)
    _compile_for_sm90(name, grouped_weight_grad_kernel, {n: f"*{dtype}" for n in ("p_a", "p_g", "p_dw", "p_scale")},
                      constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def sm90_kernel_report() -> None:
    """Compile every Triton kernel of moe_inductor for the H200 (sm_90), without a GPU, with the launch configs the
    launchers would pick: the defaults per rows-per-expert bucket, every entry of the shipped tuned table, the
    backward middle, routing, combine and activation. Prints one JSON line per kernel (``_compile_for_sm90``).
    Needs the real Triton front end: run it through ``run_without_interpreter``."""
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compiling for sm_90 needs the real Triton front end"
    from moe_inductor.kernels import configs
    from moe_inductor.kernels.activation import activation_kernel
    from moe_inductor.kernels.backward_middle import backward_middle_kernel
    from moe_inductor.kernels.combine import combine_kernel
    from moe_inductor.kernels.routing import route_count_kernel, route_place_kernel

    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for bucket in (1, 8, 64, 256, 1024, 4096):
            for gated in (True, False):
                cfg = configs.default_gemm_config(bucket, 2048, 4096, torch_dtype, gated)
                _sm90_gemm(f"gemm default {dtype} m{bucket} gated={gated}", cfg, dtype, gated=gated, a_rows=1,
                           c_rows=0, save_pre=gated)
                _sm90_gemm(f"gemm default {dtype} m{bucket} gated={gated} table", cfg, dtype, gated=gated, a_rows=1,
                           c_rows=0, save_pre=gated, table=True)
            cfg = configs.default_gemm_config(bucket, 2880, 2880, torch_dtype, True)
            _sm90_gemm(f"gemm default {dtype} m{bucket} interleaved", cfg, dtype, gated=True, a_rows=1, c_rows=0,
                       save_pre=True, k_dim=2880, interleaved=True)
        # Step-3.7's clamped silu-glu in the gate/up epilogue (nn.Linear-style concatenated weights)
        cfg = configs.default_gemm_config(1024, 2048, 4096, torch_dtype, True)
        _sm90_gemm(f"gemm default {dtype} m1024 clamped silu glu", cfg, dtype, gated=True, a_rows=1, c_rows=0,
                   save_pre=True, act=6)
        _sm90_weight_grad(f"wgrad default {dtype}", configs.default_weight_grad_config(4096, 2048, torch_dtype), dtype)
    table = json.loads((configs._TUNED_DIR / "NVIDIA_H200.json").read_text())
    for key, fields in sorted(table.items()):
        cfg = configs.LaunchConfig(**fields)
        parts = {p[0]: p[1:] for p in key.split("|")[1:]}  # "gemm|E8|N14336|K4096|torch.bfloat16|g1|a1|c0|m1024"
        if key.startswith("wgrad|"):  # "wgrad|E128|N768|K2048|torch.bfloat16|a1|g0|m256"; the scale rides on dW2,
            a_rows, g_rows = int(parts["a"]), int(parts["g"])  # whose a operand is the sorted rows (mode 0)
            _sm90_weight_grad(f"wgrad tuned {key}", cfg, "bf16", a_rows=a_rows, g_rows=g_rows, has_scale=a_rows == 0)
            continue
        if cfg == configs.POINTERS:  # a "|tma" entry that keeps the key's own pointer launch, compiled above
            continue
        gated, a_rows, c_rows = parts["g"] == "1", int(parts["a"]), int(parts["c"])
        _sm90_gemm(f"gemm tuned {key}", cfg, "bf16", gated=gated, a_rows=a_rows, c_rows=c_rows, save_pre=gated,
                   k_dim=int(parts["K"]), tma=key.endswith("|tma"))
    bf = {n: "*bf16" for n in ("p_pre", "p_h", "p_d_gate", "p_d_up", "p_b1", "p_b1_up", "p_scale")}
    bf.update(p_g="*fp32", p_d_scale="*fp32")
    for act in range(7):
        for gated in (True, False):
            if act >= 5 and not gated:  # the clamped glus are gated only
                continue
            _compile_for_sm90(f"backward middle act={act} gated={gated}", backward_middle_kernel, bf,
                              dict(NUM_EXPERTS=128, GATED=gated, ACT=act, HAS_BIAS=True, BLOCK_M=16, BLOCK_I=256),
                              floats=("alpha", "limit"))
    for act in (4, 5, 6):  # d_gate and d_up as one tensor's (gate, up) column pairs, an interleaved weight's layout
        _compile_for_sm90(f"backward middle act={act} pairs", backward_middle_kernel, bf,
                          dict(NUM_EXPERTS=32, GATED=True, ACT=act, HAS_BIAS=True, BLOCK_M=16, BLOCK_I=128, PAIRS=True),
                          floats=("alpha", "limit"))
    from moe_inductor.kernels.row_sums import expert_row_sums_kernel

    for g_rows, has_scale in ((0, False), (1, True)):
        _compile_for_sm90(f"expert row sums rows={g_rows}", expert_row_sums_kernel,
                          {"p_g": "*bf16", "p_out": "*bf16", "p_scale": "*bf16"},
                          dict(G_ROWS=g_rows, HAS_SCALE=has_scale, BLOCK_M=32, BLOCK_N=128))
    for single in (True, False):
        _compile_for_sm90(f"route place single={single}", route_place_kernel, {},
                          dict(CHOICE_MAJOR=False, TOPK=8, CHUNK=1024, BINS=256, SINGLE=single), num_warps=4)
    _compile_for_sm90("route count", route_count_kernel, {}, dict(CHOICE_MAJOR=False, TOPK=8, CHUNK=1024, BINS=256))
    _compile_for_sm90("combine", combine_kernel, {"p_rows": "*bf16", "p_ids": "*i64", "p_y": "*bf16"},
                      dict(NUM_EXPERTS=128, TOPK=8, BLOCK_H=1024))
    _compile_for_sm90("combine indexed scaled", combine_kernel,
                      {"p_rows": "*bf16", "p_ids": "*i64", "p_y": "*bf16", "p_scale": "*bf16"},
                      dict(NUM_EXPERTS=8, TOPK=2, BLOCK_H=1024, INDEXED=True, SCALED=True))
    for act in (4, 5, 6):
        _compile_for_sm90(f"activation act={act}", activation_kernel, {"p_pre": "*bf16", "p_h": "*bf16"},
                          dict(GATED=True, ACT=act, BLOCK_M=8, BLOCK_I=512), floats=("alpha", "limit"))
    from moe_inductor.kernels.gather import gather_rows_kernel

    _compile_for_sm90("gather rows", gather_rows_kernel, {"p_x": "*bf16", "p_out": "*bf16", "p_rows": "*i64"},
                      dict(BLOCK_M=32, BLOCK_N=128))
    _compile_for_sm90("activation separate up", activation_kernel,
                      {"p_pre": "*bf16", "p_h": "*bf16", "p_up_in": "*bf16", "p_pre_out": "*bf16"},
                      dict(GATED=True, ACT=1, BLOCK_M=8, BLOCK_I=512, SEPARATE_UP=True, STORE_PRE=True),
                      floats=("alpha", "limit"))
