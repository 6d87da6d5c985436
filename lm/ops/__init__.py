"""Pure tensor math of the sequence mixers: chunkwise (training) and recurrent (decoding) forms, no nn.Module."""
