"""radixserve.layers"""
