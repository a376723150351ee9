"""The engine: cleaning rules on plain arrays and TensorDicts, with no producer in view.

A call is one step, read -> plan -> write, over a state that the call
replaces only when it succeeds. The modules, in the order of the step:

* ``_options``: the validated options; ``_errors``: the exceptions;
  ``_compat``: what torch and tensordict do not promise.
* ``_kernels``: the numba kernels on plain arrays (``one_pass``: a call's
  stream ends, stored next observations and plan in one call, the only
  kernel call of a call), and the named tuples around it (``Rules``,
  ``KernelResult``).
* ``_state``: the state a cleaner keeps between calls (``State``: the
  carries and counters; ``Carry``: one producer's per-stream flags, which
  it alone encodes, and its held rows).
* ``_keys``: a batch's leaves read as rows (``Views``, one walk), done
  flags, observation keys and final entries; ``_continuity``: its stream
  ends, checked against the state.
* ``_read``: reading one call's batch into a checked ``Call``, with what
  the batch's structure decides worked out and checked once per structure
  (``Schema``).
* ``_plan``: the plan of a call (the kernel, the released held rows, the
  lost-observation policy), from flags only.
* ``_write``: the rows writer (the filter's flat rows); ``_rollout``: the
  rollout writer (the repair's ``[*E, T]`` batch).
* ``_cleaner``: the stateful ``Cleaner`` that runs the step, call after
  call, and commits it; its one undo (a batch written again after its
  write into the buffer failed); flush and state dicts.
* ``_routing``: batches of several producers, each cleaned against its
  producer's carry. A single producer's call never enters the routing.
* ``_dicts``: dicts of arrays in and out, the one conversion the repair,
  ``clean`` and ``audit`` share.
* ``_orientation``: which axis of a 2-D batch is time, from the data: the
  one detector the filter, the repair and the offline readers share.

Nothing here imports torchrl or knows a file format: the online side
(``cleanbuf.online``) and the offline side (``cleanbuf.offline``) both feed
it.
"""
