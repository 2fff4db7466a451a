"""The flight recorder: each process's bounded ring of the control messages it sent and took and
the state changes it logged, per request (recorder.py), the dump file it writes on SIGUSR1, on a
request that outlived its deadline, or when asked (dump.py, signals.py, overrun.py). `pdserve
replay` (cluster/flight_replay.py) re-drives a worker's dump into in-process twins."""
