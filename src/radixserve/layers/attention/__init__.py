"""radixserve.layers.attention"""
