package outboxtest

import (
	"context"
	"fmt"
	"sync"
	"time"

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
