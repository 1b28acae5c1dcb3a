"""The plumbing between an engine and a front end: the request's Admission, the engine loop, the engine in a thread
or a process of its own, and what crosses a cluster's wire. server/ and cluster/ use it; it imports neither."""
