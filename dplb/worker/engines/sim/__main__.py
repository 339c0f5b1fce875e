"""``python -m dplb.worker.engines.sim --uds PATH | --port P [--<sim knob> VALUE …]``: serve one sim engine."""

from dplb.worker.engines.sim.engine import main

if __name__ == "__main__":
    main()
