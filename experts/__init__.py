"""experts: decentralized mixture-of-experts — expert servers, remote experts with autograd, and a
DMoE layer that finds its experts through the DHT and keeps working when some of them vanish."""
