"""What runs did, drawn and compared after the fact.

  reports.plots        a run's PNGs: losses, learning rate, expert load (matplotlib)
  reports.compare      runs side by side: one table, their curves, paired differences (`nanollama4 compare`)
  reports.compareplots the plots of a comparison
  reports.routes       `route_stream`: every token's routing slots over a whole text, in windows
  reports.experts      `nanollama4 experts`: what fills each expert and what it owns, against a null
  reports.specialise   the arithmetic under it: lift, mutual information, the shuffle null, intervals
  reports.expertsview  that report as tables and JSON; reports.expertspage as an offline page
  reports.expertstable the per-expert table `compare --experts` reads

One prompt through the model, layer by layer, is explain/'s; a whole text's routing is here.
"""
