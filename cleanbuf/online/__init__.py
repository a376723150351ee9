"""The online side: the producers and processes the engine meets while data is collected.

The TorchRL replay-buffer transform (``AutoresetFilter``), reading a
producer's auto-reset behaviour (``for_env``), the filter's copies in worker
processes and Ray actors, the lossless TorchRL env and the raw-loop row
builder. This is the only place that knows collectors.
"""
