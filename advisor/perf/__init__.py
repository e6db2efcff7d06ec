"""The advisor's performance model: what one forward step costs on a deployment (`steps`), what
each runtime's scheduler puts in a step (`schedulers`), a step-level simulation of a workload
through them (`simulate`), its steady-state closed form for searching many deployments
(`analytic`), the efficiencies fitted to published measurements (`fit`, `calibration`), and the
deployment search (`search`)."""
