"""`pdserve advise`: which layout to run, predicted before running it. costs.py holds what one
worker's step costs, profile.py measures it on the model, simulator.py replays a recorded request
stream through a layout (a discrete-event model of the engines and the router's placement),
layouts.py reads layouts from cluster YAMLs, and report.py ranks them by predicted goodput."""
