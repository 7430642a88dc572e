"""Simulators that drive the cache, the eviction policies and the prefetchers.

replay.py: access-level demand paging, the model of paper 001 (hit rates against Belady's optimum);
kernels.py compiles the policies' replay kernels with Numba, which the replay runs where it can.
timed/: discrete-event simulation on a hardware profile, with transfer queues (transfers.py) and
prefetchers (TTFT, TPOT, stalls, traffic); split.py: MoEpic's split experts, an option of the timed run;
configurator/: MoEpic's configurator (paper 004, Algorithm 1), which replays LCP on the cache for its
statistics and which the timed simulator reruns online. The runtime shares cache.py and transfers.py.
"""
