"""Length prediction, engine cost model, draft budget policy, placement and the makespan simulator."""
