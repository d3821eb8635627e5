package transport

import (
	"context"
	"hash/fnv"
	"sync"
)

// Lanes runs work concurrently across keys and strictly in submission order
// within a key: each key hashes to one of a fixed number of lanes, and each
// lane is one goroutine working through its queue. Consumers use it to
// apply different aggregates in parallel while one aggregate's events run
// one after the other, in the order the broker delivered them.
//
// A lane's work receives the lane number, so callers can keep per-lane state
// (such as which aggregates are waiting for a retry) without locks: every
// key always lands in the same lane.
type Lanes struct {
	queues []chan func(lane int)
	wg     sync.WaitGroup
}

// NewLanes starts n lanes (at least 1), each queueing up to depth items.
func NewLanes(n, depth int) *Lanes {
	n = max(n, 1)
	l := &Lanes{queues: make([]chan func(int), n)}
	for i := range l.queues {
		q := make(chan func(int), max(depth, 0))
		l.queues[i] = q
		l.wg.Add(1)
		go func(lane int) {
			defer l.wg.Done()
			for fn := range q {
				fn(lane)
			}
		}(i)
	}
	return l
}

// Len is the number of lanes.
func (l *Lanes) Len() int { return len(l.queues) }

// Submit queues fn on key's lane, waiting while that lane's queue is full.
// It returns ctx's error if ctx ends first (fn then never runs).
func (l *Lanes) Submit(ctx context.Context, key string, fn func(lane int)) error {
	select {
	case l.queues[LaneOf(key, len(l.queues))] <- fn:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close stops accepting work and waits until every queued item has run.
// Submit must not be called during or after Close.
func (l *Lanes) Close() {
	for _, q := range l.queues {
		close(q)
	}
	l.wg.Wait()
}

// LaneOf is the lane (0..n-1) that key maps to: FNV-1a, so the mapping is
// the same in every process and across restarts.
func LaneOf(key string, n int) int {
	if n <= 1 {
		return 0
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(key))
	return int(h.Sum32() % uint32(n))
}

// Queued is how many items wait on lane behind the one running: a lane's
// work can gather them into one batch (the broker consumers apply a lane's
// waiting messages in one transaction).
func (l *Lanes) Queued(lane int) int { return len(l.queues[lane]) }
