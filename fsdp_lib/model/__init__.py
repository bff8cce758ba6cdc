"""The model wing: building any HF causal LM on the meta device and sharding it per decoder layer with FSDP2, HF
weight files in and out, LoRA/QLoRA adapters, the chunked loss, the start-up probes, the memory plan and the model's
anatomy. No re-exports: import the modules (a re-export would drag torch into the helper tools)."""
