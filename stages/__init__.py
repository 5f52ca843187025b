"""The default image pipeline: preprocess, model and postprocess, plugged into `worker`."""
