"""Comparison tolerances per graph dtype, shared by export validation and dflash2-compare (from the
dtype table, dflash2.dtypes)."""

from dflash2.dtypes import BY_NAME, GRAPH_DTYPES

TOLERANCES = {n: (BY_NAME[n].atol, BY_NAME[n].rtol) for n in GRAPH_DTYPES}  # (atol, rtol)
ID_MISMATCH_SHARE = {n: BY_NAME[n].id_share for n in GRAPH_DTYPES}  # share of id entries allowed to differ
