from setuptools import find_packages, setup

setup(
    name="vc_compile",
    version="0.1.0",
    description="torch.compile backend 'vcattn': 8-bit (V-Smooth, ExpCast) and token-sparse (MC-Sparse) "
                "attention for video diffusion transformers",
    packages=find_packages(include=["vc_compile", "vc_compile.*"]),
    package_data={"vc_compile": ["demo/weights/*.safetensors", "demo/weights/*.json", "passes/README.md",
                                 "tune/*.json"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "triton>=3.6", "sympy", "nvidia-ml-py", "diffusers==0.42.1",
                      "safetensors", "pillow", "numpy"],
    extras_require={"test": ["pytest", "transformers"]},
    entry_points={"torch_dynamo_backends": ["vcattn = vc_compile.backend:vcattn"]},
)
