"""The rates the planner's step-time model uses (ds_longctx/planner/rates.py), measured on one CUDA GPU:
bf16 matmuls (square and narrow), HBM copy/add bandwidth, pinned host<->device copies, cuDNN causal attention.
Run on the lent H100 on 2026-11-26 (bench/results/gpu_rates_h100.json):  python3 bench/gpu_rates.py
"""
import torch,time,json,os
def t(f,n=5):
    f();torch.cuda.synchronize();s=time.perf_counter()
    for _ in range(n):f()
    torch.cuda.synchronize();return (time.perf_counter()-s)/n
r={"device":torch.cuda.get_device_name(),"torch":torch.__version__,"date":time.strftime("%Y-%m-%d %H:%M UTC",time.gmtime())}
b=torch.bfloat16
for m,k,n in[(8192,8192,8192),(131072,2048,64),(131072,2048,8192),(131072,8192,2048),(16384,2048,128256)]:
    A=torch.randn(m,k,device="cuda",dtype=b);B=torch.randn(k,n,device="cuda",dtype=b)
    r[f"mm_{m}x{k}x{n}_tflops"]=2*m*k*n/t(lambda:A@B)/1e12;del A,B
x=torch.empty(2**29,device="cuda",dtype=b);y=torch.empty_like(x)
r["hbm_copy_GBps"]=2*x.nbytes/t(lambda:y.copy_(x))/1e9
r["hbm_add_GBps"]=3*x.nbytes/t(lambda:torch.add(x,y))/1e9
h=torch.empty(2**28,dtype=b,pin_memory=True);d=torch.empty(2**28,device="cuda",dtype=b)
r["h2d_pinned_GBps"]=h.nbytes/t(lambda:d.copy_(h,non_blocking=True))/1e9
r["d2h_pinned_GBps"]=h.nbytes/t(lambda:h.copy_(d,non_blocking=True))/1e9
A=aten=torch.ops.aten
for dh in(64,128):
    q=torch.randn(1,1,32768,dh,device="cuda",dtype=b,requires_grad=True)
    def f():
        o=torch.nn.functional.scaled_dot_product_attention(q,q,q,is_causal=True);o.backward(o)
    r[f"sdpa_causal_32k_1h_d{dh}_fwdbwd_s"]=t(f)
    q=torch.randn(1,32,131072,dh,device="cuda",dtype=b,requires_grad=True)
    r[f"sdpa_causal_128k_32h_d{dh}_fwdbwd_s"]=t(f,2)
print(json.dumps(r,indent=1));open(os.environ["OUT"]+"/rates.json","w").write(json.dumps(r,indent=1))
