"""A pipelined SQS batch-inference worker: the runtime, generic over models."""

__version__ = "0.1.0"
