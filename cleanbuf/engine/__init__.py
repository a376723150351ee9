"""The engine: cleaning rules on plain arrays and TensorDicts, with no producer in view.

numba kernels plan a call from flags (``_kernels``); the stateful
:class:`~cleanbuf.engine._cleaner.Cleaner` reads a batch, runs the plan,
moves and patches the kept rows, and keeps the carry state between calls.
Nothing here imports torchrl or knows a file format: the online side
(``cleanbuf.online``) and the offline side (``cleanbuf.offline``) both feed
it.
"""
