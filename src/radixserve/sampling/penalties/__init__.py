"""radixserve.sampling.penalties"""
