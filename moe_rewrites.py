"""The log channel behind ``TORCH_LOGS="moe_rewrites"``: one record per MoE region moe_inductor rewrote, with the
rewritten graph.

torch reads TORCH_LOGS once, at ``import torch``, before any plugin is loaded, and accepts only names it already
knows or names of importable modules. This module exists so that the name is importable from the start; moe_inductor
writes its records to the logger of the same name (``logging.getLogger("moe_rewrites")``). Nothing here is imported
by moe_inductor itself.
"""
