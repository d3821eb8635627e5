package transporttest

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// TestProxyPartition: a partitioned connection carries nothing either way
// and its close does not reach the server, while a new connection goes
// through; Heal closes the server's end.
func TestProxyPartition(t *testing.T) {
	p, dial := proxyRig(t)
	read, send := proxyRead, func(c net.Conn, s string) { t.Helper(); proxySend(t, c, s) }

	oldC, oldS := dial()
	send(oldC, "a")
	if got, err := read(oldS, 5*time.Second); got != "a" {
		t.Fatalf("before the partition the server read %q, %v; want a", got, err)
	}
	if n := p.Partition(); n != 1 {
		t.Fatalf("Partition() = %d, want 1", n)
	}
	send(oldC, "b")
	send(oldS, "c")
	if got, err := read(oldS, 300*time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the server read %q, %v across the partition; want nothing (a timeout)", got, err)
	}
	if got, err := read(oldC, 300*time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the client read %q, %v across the partition; want nothing (a timeout)", got, err)
	}
	// The client gives up on its connection: the server must not see it.
	_ = oldC.Close()
	if got, err := read(oldS, 300*time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the server read %q, %v after the client closed across the partition; want nothing (a timeout)", got, err)
	}

	newC, newS := dial()
	send(newC, "d")
	if got, err := read(newS, 5*time.Second); got != "d" {
		t.Fatalf("a new connection during the partition: the server read %q, %v; want d", got, err)
	}
	send(newS, "e")
	if got, err := read(newC, 5*time.Second); got != "e" {
		t.Fatalf("a new connection during the partition: the client read %q, %v; want e", got, err)
	}

	if n := p.Heal(); n != 1 {
		t.Fatalf("Heal() = %d, want 1 (the partitioned connection)", n)
	}
	if got, err := read(oldS, 5*time.Second); !errors.Is(err, io.EOF) {
		t.Fatalf("after Heal the server read %q, %v on the partitioned connection; want EOF", got, err)
	}
	send(newC, "f")
	if got, err := read(newS, 5*time.Second); got != "f" {
		t.Fatalf("Heal touched the new connection: the server read %q, %v; want f", got, err)
	}
}

// proxyRig starts a Proxy in front of a server that sends and reads only
// what the test tells it to; dial connects a client through the proxy and
// returns both ends.
func proxyRig(t *testing.T) (*Proxy, func() (client, server net.Conn)) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	accepted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = c.Close() })
			accepted <- c
		}
	}()
	p := NewProxy(t, ln.Addr().String())
	return p, func() (net.Conn, net.Conn) {
		t.Helper()
		c, err := net.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		select {
		case s := <-accepted:
			return c, s
		case <-time.After(5 * time.Second):
			t.Fatal("the proxy did not connect to the server")
		}
		return nil, nil
	}
}

// proxyRead reports what arrives on c within d: the bytes, or the error.
func proxyRead(c net.Conn, d time.Duration) (string, error) {
	_ = c.SetReadDeadline(time.Now().Add(d))
	b := make([]byte, 16)
	n, err := c.Read(b)
	return string(b[:n]), err
}

func proxySend(t *testing.T, c net.Conn, s string) {
	t.Helper()
	if _, err := c.Write([]byte(s)); err != nil {
		t.Fatal(err)
	}
}

// TestProxyPause: a paused proxy holds what either side sends, and delivers
// it on Resume; the connections stay open.
func TestProxyPause(t *testing.T) {
	p, dial := proxyRig(t)
	c, s := dial()
	proxySend(t, c, "a")
	if got, err := proxyRead(s, 5*time.Second); got != "a" {
		t.Fatalf("before the pause the server read %q, %v; want a", got, err)
	}
	p.Pause()
	proxySend(t, c, "b")
	proxySend(t, s, "c")
	if got, err := proxyRead(s, 300*time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the server read %q, %v while paused; want nothing (a timeout)", got, err)
	}
	if got, err := proxyRead(c, 300*time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the client read %q, %v while paused; want nothing (a timeout)", got, err)
	}
	p.Resume()
	if got, err := proxyRead(s, 5*time.Second); got != "b" {
		t.Fatalf("after Resume the server read %q, %v; want b (held)", got, err)
	}
	if got, err := proxyRead(c, 5*time.Second); got != "c" {
		t.Fatalf("after Resume the client read %q, %v; want c (held)", got, err)
	}
}
