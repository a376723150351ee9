"""The engine: cleaning rules on plain arrays and TensorDicts, with no producer in view.

A call is one step, read -> plan -> write, over a state that the call replaces only when it
succeeds. The modules, in the order of the step:

* ``_options``: the validated options; ``_errors``: the exceptions; ``_compat``: what torch
  and tensordict do not promise.
* ``_kernels``: the numba kernels on plain arrays (``one_pass``, the only kernel call of a
  call that has something to clean) and their named tuples (``Rules``, ``KernelResult``).
* ``_state``: what a cleaner keeps between calls (``State``: carries and counters; ``Carry``:
  one producer's per-stream flags, which it alone encodes, and its held rows).
* ``_keys``: a batch's leaves as rows (``Views``), done flags, observation keys and final
  entries; ``_continuity``: its stream ends, checked against the state.
* ``_read``: one call's batch read into a checked ``Call``; what the batch's structure
  decides is worked out once per structure (``Schema``).
* ``_write``: the filter's flat rows; ``_rollout``: the repair's ``[*E, T]`` batch.
* ``_cleaner``: the stateful ``Cleaner`` that runs and commits the step; the plan of a call
  (the kernel's result read, the released held rows, the lost-observation policy); its one
  undo; flush and state dicts.
* ``_routing``: batches of several producers, each against its producer's carry (a single
  producer's call never enters it).
* ``_dicts``: dicts of arrays in and out, shared by the repair, ``clean`` and ``audit``.
* ``_orientation``: which axis of a 2-D batch is time, from the data (filter, repair and
  offline readers alike).

Nothing here imports torchrl or knows a file format: ``cleanbuf.online`` and
``cleanbuf.offline`` both feed it.
"""
