"""radixserve.server"""
