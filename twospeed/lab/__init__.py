"""The latency lab: load generation against any OpenAI-compatible endpoint (requests and multi-call agent jobs),
per-lane reports of both speeds, gates, the bill, A/B comparison and a diagnosis of which speed hurt
(`twospeed bench`, `twospeed compare`, `twospeed diagnose`, `make demo`)."""
