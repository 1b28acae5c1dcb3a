"""The planner: hardware profiles, the roofline cost model, the toy two-clocks model."""
