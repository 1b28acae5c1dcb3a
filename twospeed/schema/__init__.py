"""The vocabulary every layer shares (torch-free): the split clock and bill, the speculation trace, prices, lanes,
SLO objectives and verdicts."""
