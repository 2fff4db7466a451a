"""Role switching, the worker's side: a worker of a disaggregated cluster that serves prefill or
decode and flips between them at run time (switchable_worker.py). The router decides the flips
(router/role_switch/)."""
