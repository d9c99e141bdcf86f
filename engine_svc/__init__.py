"""Engine service: the native PyTorch engine (core/, models/) behind gRPC."""
