"""The layout planner (`pdserve-plan`): from a profile of one GPU (profile.py, written by
scripts/profile_layout.py), a workload's length distributions and an SLO, it predicts each layout's goodput per
GPU by simulating it (simulate.py, search.py) and recommends one (cli.py). Pure Python and numpy: no torch."""
