"""Where arrays live: the ("data", "pipe", "tensor") mesh, the ZeRO stages and tensor rules as
sharding trees (`partition`), and the pipeline schedule that runs a layer stack over "pipe"."""
