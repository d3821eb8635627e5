package transporttest

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Proxy is a TCP proxy a test starts in front of a server (PostgreSQL, a
// broker) and cuts: the server itself is never touched. Cut closes every
// connection through it; Down also refuses new ones (they are accepted and
// closed at once) until Up. Partition leaves the connections open and
// silent, as a network partition does, until Heal. Pause holds every byte
// back, as a server that hangs, and Resume delivers them.
type Proxy struct {
	ln     net.Listener
	target string
	paused atomic.Bool

	mu    sync.Mutex
	links map[*link]struct{}
	down  bool
}

// link is one client connection and its connection to the server.
type link struct {
	client, server net.Conn
	partitioned    atomic.Bool
	once           sync.Once
	released       chan struct{} // closed with the sockets
}

func (l *link) isReleased() bool {
	select {
	case <-l.released:
		return true
	default:
		return false
	}
}

func (l *link) close() {
	l.once.Do(func() {
		_ = l.client.Close()
		_ = l.server.Close()
		close(l.released)
	})
}

// NewProxy listens on a free loopback port and forwards to target
// ("host:port") until the test ends.
func NewProxy(tb testing.TB, target string) *Proxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &Proxy{ln: ln, target: target, links: map[*link]struct{}{}}
	go p.accept()
	tb.Cleanup(func() { _ = ln.Close(); p.Cut() })
	return p
}

// Addr is the proxy's "host:port".
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		down := p.down
		p.mu.Unlock()
		if down {
			_ = c.Close()
			continue
		}
		s, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			_ = c.Close()
			continue
		}
		l := &link{client: c, server: s, released: make(chan struct{})}
		p.mu.Lock()
		p.links[l] = struct{}{}
		p.mu.Unlock()
		go p.pipe(l, s, c)
		go p.pipe(l, c, s)
	}
}

// pipe copies src to dst until either side closes, then closes both; on a
// partitioned link it stops instead and leaves both open (see Partition).
func (p *Proxy) pipe(l *link, dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if l.partitioned.Load() {
			// What was read is lost in the partition. Reading no more lets
			// the sender's socket buffer fill as with dropped packets, and
			// neither side sees the other close.
			<-l.released
			break
		}
		for p.paused.Load() && !l.partitioned.Load() && !l.isReleased() {
			time.Sleep(5 * time.Millisecond)
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	l.close()
	p.mu.Lock()
	delete(p.links, l)
	p.mu.Unlock()
}

// Cut closes every connection through the proxy, partitioned ones too, and
// returns how many client connections it cut; new ones are accepted as
// usual.
func (p *Proxy) Cut() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := len(p.links)
	for l := range p.links {
		l.close()
	}
	p.links = map[*link]struct{}{}
	return n
}

// Down cuts every connection and refuses new ones until Up.
func (p *Proxy) Down() int {
	p.mu.Lock()
	p.down = true
	p.mu.Unlock()
	return p.Cut()
}

// Up accepts connections again.
func (p *Proxy) Up() {
	p.mu.Lock()
	p.down = false
	p.mu.Unlock()
}

// Partition stops forwarding on every open connection, both ways, and
// returns how many client connections it partitioned. Their sockets stay
// open: no FIN or RST reaches either side, even when the client gives up on
// its connection and closes it, so each side notices only by its own
// timeouts (pings, keepalives). New connections go through as usual, as
// when a client reconnects by another path.
func (p *Proxy) Partition() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for l := range p.links {
		if !l.partitioned.Swap(true) {
			n++
		}
	}
	return n
}

// Heal ends the partition: the partitioned connections are closed at both
// ends, as the client's reset reaches a server once the network is back
// (the client has given up on them by then). It returns how many it closed.
func (p *Proxy) Heal() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for l := range p.links {
		if l.partitioned.Load() {
			l.close()
			delete(p.links, l)
			n++
		}
	}
	return n
}

// Pause stops forwarding on every connection, new ones too, holding what
// was sent: both sides see a peer that hangs, not one that is gone.
func (p *Proxy) Pause() { p.paused.Store(true) }

// Resume forwards again, what was held first.
func (p *Proxy) Resume() { p.paused.Store(false) }
