package outboxtest

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/proccpu"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// Drive publishes msgs through pub the way the dispatcher's publish step
// does, without the outbox: concurrency callers, each taking the next batch
// messages and calling Publish with them. It returns messages per second,
// or the first message error.
func Drive(ctx context.Context, pub outbox.Publisher, msgs []outbox.Message, concurrency, batch int) (float64, error) {
	var (
		mu       sync.Mutex
		pos      int
		firstErr error
		wg       sync.WaitGroup
	)
	start := time.Now()
	for w := 0; w < concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				lo := pos
				pos = min(pos+batch, len(msgs))
				hi := pos
				stop := firstErr != nil
				mu.Unlock()
				if lo >= hi || stop {
					return
				}
				for i, err := range pub.Publish(ctx, msgs[lo:hi]) {
					if err != nil {
						mu.Lock()
						if firstErr == nil {
							firstErr = fmt.Errorf("publish %s: %w", msgs[lo+i].EventID, err)
						}
						mu.Unlock()
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return 0, firstErr
	}
	return float64(len(msgs)) / time.Since(start).Seconds(), nil
}

// DrainRate enqueues evs into db's outbox (500 to a transaction), drains
// them with a dispatcher publishing through pub (cfg; Logger and the rest
// as given), and returns the drain's rate and what it used of the machine,
// this process and the named processes (proccpu). The transport benchmarks
// run it beside the raw client's rate.
func DrainRate(ctx context.Context, db *pgxpool.Pool, evs []envelope.Envelope, pub outbox.Publisher, cfg outbox.DispatcherConfig,
	processes ...string) (proccpu.Cost, error) {
	for rest := evs; len(rest) > 0; {
		batch := rest[:min(500, len(rest))]
		rest = rest[len(batch):]
		if err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, batch...) }); err != nil {
			return proccpu.Cost{}, fmt.Errorf("enqueue: %w", err)
		}
	}
	d, err := outbox.NewDispatcher(db, pub, cfg)
	if err != nil {
		return proccpu.Cost{}, err
	}
	var drainErr error
	cost := proccpu.Measure(len(evs), func() float64 {
		start := time.Now()
		drainErr = d.Drain(ctx)
		return float64(len(evs)) / time.Since(start).Seconds()
	}, processes...)
	if drainErr != nil {
		return cost, fmt.Errorf("drain: %w", drainErr)
	}
	if tot := d.Totals(); tot.Sent != int64(len(evs)) {
		return cost, fmt.Errorf("sent %d of %d (%+v)", tot.Sent, len(evs), tot)
	}
	return cost, nil
}
