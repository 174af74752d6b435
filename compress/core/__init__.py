"""The numbers: a quantization scheme, the primitives that map floats onto it, the packed tensor that holds the result,
microscaling formats, and QuantLinear, the layer that runs it."""
