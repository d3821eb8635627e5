package localdemo

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

// The local scheduler holds invocations to their deadline as Lambda does:
// one that returns after it is reported as an overrun; one that returns in
// time, or promptly after a stop, is not.
func TestScheduleReportsOverruns(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		work        time.Duration
		wantOverrun bool
	}{
		{"returns before its deadline", 50 * time.Millisecond, false},
		{"runs 300ms past its deadline", 500 * time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithCancel(context.Background())
			var calls, overruns atomic.Int64
			var late atomic.Int64
			done := make(chan struct{})
			go func() {
				Schedule(ctx, time.Hour, 200*time.Millisecond, func(context.Context) {
					calls.Add(1)
					time.Sleep(tc.work) // ignores its context, like a stuck handler
				}, func(l time.Duration) {
					overruns.Add(1)
					late.Store(int64(l))
				})
				close(done)
			}()
			time.Sleep(700 * time.Millisecond)
			cancel()
			<-done
			if calls.Load() != 1 {
				t.Fatalf("%d calls, want 1", calls.Load())
			}
			if got := overruns.Load() > 0; got != tc.wantOverrun {
				t.Fatalf("overrun reported %v, want %v", got, tc.wantOverrun)
			}
			if tc.wantOverrun && time.Duration(late.Load()) < 200*time.Millisecond {
				t.Fatalf("reported %s late, want about 300ms", time.Duration(late.Load()))
			}
		})
	}
}
