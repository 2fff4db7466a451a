"""Role switching, the router's side: when to flip a worker between prefill and decode
(controller.py, fed by each finished request's TTFT and TPOT) and the flip itself
(flips.py: the router routes the new role's work to it at once, the worker finishes the old
role's, cluster/role_switch/)."""
