"""The advisor's performance model: one way to serve a model (`deployment`), the KV cache a rank
holds (`memory`), what one forward step costs (`steps`), what each runtime's scheduler puts in a
step (`schedulers`), a step-level simulation of a workload through them (`simulate`) and the
figures a benchmark would report (`predict`), the efficiencies fitted to published measurements
(`efficiency`, `fit`, `calibration`), and the deployment search (`search`, `frontier`)."""
