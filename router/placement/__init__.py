"""Per-request placement in disaggregated mode (`router.disaggregation`): where a prompt is
computed (a prefill worker with its KV shipped, the decode worker itself, or only its uncached
suffix there), chosen by a cost model fed by what the workers measure and report. The router's
attempts (router/attempt.py) ask the `Placer` (placer.py) before anything is sent.
"""
