package lambdaruntime

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// recordingTB collects the protocol violations the server reports instead
// of failing the test, so the test can expect them.
type recordingTB struct {
	testing.TB
	mu     sync.Mutex
	errors []string
}

func (r *recordingTB) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

func (r *recordingTB) violations() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.errors, "\n")
}

func call(t *testing.T, method, url, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// A runtime driven by hand: the next event carries Lambda's headers and
// the payload (a missing one as {}), the answer reaches Invoke, and answers
// for another request id or init errors after init are refused as the
// Runtime API refuses them.
func TestServerSpeaksTheRuntimeAPI(t *testing.T) {
	tb := &recordingTB{TB: t}
	srv := NewServer(tb, "fn")
	base := "http://" + srv.Addr()
	deadline := time.Now().Add(5 * time.Second).Truncate(time.Millisecond)

	done := make(chan Result, 1)
	go func() {
		r, err := srv.Invoke(context.Background(), Invocation{Deadline: deadline}, time.Second)
		if err != nil {
			t.Error(err)
		}
		done <- r
	}()
	next := call(t, http.MethodGet, base+PathNext, "")
	body, _ := io.ReadAll(next.Body)
	id := next.Header.Get(HeaderRequestID)
	if next.StatusCode != 200 || string(body) != "{}" || id == "" {
		t.Fatalf("next: %d %q request id %q", next.StatusCode, body, id)
	}
	if ms, _ := strconv.ParseInt(next.Header.Get(HeaderDeadlineMs), 10, 64); ms != deadline.UnixMilli() {
		t.Errorf("deadline header %s, want %d", next.Header.Get(HeaderDeadlineMs), deadline.UnixMilli())
	}
	if !strings.HasSuffix(next.Header.Get(HeaderFunctionARN), ":function:fn") || next.Header.Get(HeaderTraceID) == "" {
		t.Errorf("function ARN %q trace id %q", next.Header.Get(HeaderFunctionARN), next.Header.Get(HeaderTraceID))
	}

	if r := call(t, http.MethodPost, base+pathInvoke+"not-"+id+"/response", `{}`); r.StatusCode != http.StatusBadRequest {
		t.Errorf("response for an unknown request id: %d, want 400", r.StatusCode)
	}
	if r := call(t, http.MethodPost, base+pathInvoke+id+"/response", `{"ok":true}`); r.StatusCode != http.StatusAccepted {
		t.Errorf("response: %d, want 202", r.StatusCode)
	}
	if r := <-done; string(r.Response) != `{"ok":true}` || r.TimedOut || r.RequestID != id {
		t.Errorf("Invoke returned %+v", r)
	}
	if r := call(t, http.MethodPost, base+PathInitError, `{"errorMessage":"late","errorType":"X"}`); r.StatusCode != http.StatusForbidden {
		t.Errorf("init error after init: %d, want 403", r.StatusCode)
	}
	v := tb.violations()
	if !strings.Contains(v, "not the invocation in progress") || !strings.Contains(v, "init error after init") {
		t.Errorf("violations reported:\n%s", v)
	}
}

// An invocation nobody answers times out at its deadline, as Lambda would
// end it.
func TestUnansweredInvocationTimesOut(t *testing.T) {
	srv := NewServer(t, "fn")
	start := time.Now()
	r, err := srv.Invoke(context.Background(), Invocation{Deadline: start.Add(200 * time.Millisecond)}, 100*time.Millisecond)
	if err != nil || !r.TimedOut || r.Response != nil || r.Err != nil {
		t.Fatalf("Invoke = %+v, %v; want a timeout", r, err)
	}
}
