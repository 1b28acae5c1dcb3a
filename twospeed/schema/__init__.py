"""The vocabulary every layer shares (torch-free): lanes, SLO objectives and verdicts."""
