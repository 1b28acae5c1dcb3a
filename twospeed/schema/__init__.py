"""The vocabulary every layer shares (torch-free): the split clock and bill, the speculation trace, prices, the
bytes of every weight format and KV cache dtype, lanes, SLO objectives and verdicts."""
