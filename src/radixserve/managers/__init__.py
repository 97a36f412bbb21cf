"""radixserve.managers"""
