"""radixserve.mem_cache"""
