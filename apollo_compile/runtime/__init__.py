"""What runs at training time: lane streams, subgraph compilation, the generated runtime, CUDA graphs."""
