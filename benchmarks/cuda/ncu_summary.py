"""Sum ncu gpu__time_duration per kernel name (first template/args stripped)."""
import csv, sys, re, collections
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
hdr = rows[0]; ki = hdr.index("Kernel Name"); vi = hdr.index("Metric Value"); ui = hdr.index("Metric Unit")
tot = collections.OrderedDict(); cnt = collections.Counter()
for r in rows[1:]:
    name = re.sub(r"\(.*", "", r[ki])[:90]
    v = float(r[vi].replace(",", "")); u = r[ui]
    ms = v * {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}.get(u, 1e-6)
    tot[name] = tot.get(name, 0) + ms; cnt[name] += 1
for k, v in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"{v:9.3f} ms  {cnt[k]:5d}x  {k}")
print(f"{sum(tot.values()):9.3f} ms total")
