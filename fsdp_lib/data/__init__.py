"""The data wing: the token cache (tokenising each split once, checksummed), packing into blocks, chat and preference
encoding, dataset mixtures, the micro-batch, and the data plan that makes a resume exact at any process count.
No re-exports: import the modules."""
