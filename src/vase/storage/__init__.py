"""Every way of holding K/V, one module each behind the declared protocol (protocol.py): dense, quantized
(with its bit packing), fp8, the fixed-shape stores of the compiled step, and the registry that ties them to a request."""
