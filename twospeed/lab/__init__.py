"""The latency lab: load generation against any OpenAI-compatible endpoint, per-lane reports of both speeds,
gates, the bill, and A/B comparison (`twospeed bench`, `twospeed compare`, `make demo`)."""
