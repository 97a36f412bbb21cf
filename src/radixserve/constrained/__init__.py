"""radixserve.constrained"""
