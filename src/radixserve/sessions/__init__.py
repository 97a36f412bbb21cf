"""radixserve.sessions"""
