"""Worker benchmarks: the model runner's prefill/decode roofline (worker.py), the decode kernels' tiles
(decode_kernels.py) and the KV connector's overhead around the transceiver (kv_connector.py). Each script is run as
`python bench/worker/<script>.py` (docs/benchmarks.md)."""
