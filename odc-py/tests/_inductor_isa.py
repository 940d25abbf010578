"""Inductor's choice of the CPU's vector instruction set, made once in the fork server (the compile tests list
this module in their ``RANK_PRELOAD``) so that every rank forked from it inherits the answer.

Inductor checks each instruction set the CPU reports by building a small kernel and loading it in a new
interpreter that imports torch (``torch._inductor.cpu_vec_isa``), and caches the answer in the process only. In
forked ranks that ran in every rank: on torch 2.11, 24 such interpreters in the 4-rank compile test, about 73 of
its 108 core-seconds.
"""

from __future__ import annotations

from torch._inductor.cpu_vec_isa import pick_vec_isa

VEC_ISA = pick_vec_isa()
